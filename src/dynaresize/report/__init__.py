"""Reports built from records (read only): figures, timelines and traces."""
