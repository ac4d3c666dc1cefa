"""The headline table that opens a run's section of `dynaresize report`: the figures of
`metrics.headline_rows` (the same rows `dynaresize run` prints at its end), in the run's time
unit, said under the table.

For an emulated run the simulator's prediction is made again from the run's `config` record
(`emulate.predict.headline_prediction`, the function the run's closing summary uses), with
today's cost models; a config this version can no longer build gives no prediction and says why
instead of failing the page. A simulated run (no `span` records) has no prediction row: it is
the simulator's own run; its summary counts resizes but not each way, so those come from its
`resize` records.

Invariant: every text from the records is HTML-escaped.
"""

from __future__ import annotations

import html

from dynaresize.errors import DynaresizeError
from dynaresize.metrics import NO_PREDICTION_UNPACED, Prediction, headline_rows, resize_counts
from dynaresize.report.load import RunRecords

HEADLINE_ID = "headline"  # the first table of a run's section (the browser test looks for it)


def run_prediction(run: RunRecords) -> tuple[Prediction | None, str]:
    """(the simulator's prediction for the run's job, or None and why there is none)."""
    if run.simulated:
        return None, ""
    configs = run.of("config")
    if not configs or not isinstance(configs[0].get("config"), dict):
        return None, "none: the run has no config record to predict from"
    data = configs[0]["config"]
    if not (data.get("cluster") or {}).get("emulate"):
        return None, NO_PREDICTION_UNPACED
    from dynaresize.config_load import build_config
    from dynaresize.emulate.predict import headline_prediction

    try:
        return headline_prediction(build_config(data)), ""
    except (DynaresizeError, ValueError, KeyError, TypeError) as exc:  # an older run's config, today's checks
        return None, f"none: the simulator cannot rebuild this run's job today ({exc})"


def headline_html(run: RunRecords, *, table_id: str = HEADLINE_ID) -> str:
    """The table (figure, value, unit) and a line naming the time unit; a note if no summary."""
    summary = run.summary
    if not summary:
        return '<p class="note">No summary record (the run has not finished): no headline.</p>'
    if "resizes_to_rollout" not in summary:  # the simulator's summary counts resizes, not each way
        summary = {**resize_counts(r["to_role"] for r in run.of("resize")), **summary}
    prediction, why = run_prediction(run)
    rows = headline_rows(summary, prediction, no_prediction=why, simulated=run.simulated)
    esc = html.escape
    body = "".join(f'<tr><th scope="row">{esc(name)}</th><td class="num">{esc(value)}</td><td>{esc(unit)}</td></tr>'
                   for name, value, unit in rows)
    unit = "simulated seconds" if run.simulated else summary.get("time_unit") or "seconds (unit not recorded)"
    predicted = (' The prediction is the simulator\'s for this run\'s config, made when this page was written.'
                 if prediction is not None else "")
    return (f'<table id="{esc(table_id)}" class="headline"><tr><th>figure</th><th>value</th><th>unit</th></tr>'
            f"{body}</table><p class=\"note\">Times are {esc(unit)}.{predicted}</p>")
