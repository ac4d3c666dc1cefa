from dynaresize.cli import main

raise SystemExit(main())
