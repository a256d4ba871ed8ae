"""The dashboard's stylesheet, served at `/dashboard/style.css` (the pages allow no inline style)."""

STYLESHEET = """
:root { color-scheme: light; --ink: #1e272e; --muted: #6b7785; --line: #e3e8ee; --bg: #f5f7fa; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--ink); background: var(--bg); }
header { display: flex; flex-wrap: wrap; align-items: center; gap: 8px 24px;
         padding: 16px 24px; background: #fff; border-bottom: 1px solid var(--line); }
header h1 { margin: 0; font-size: 20px; }
header p { margin: 0; color: var(--muted); flex: 1 1 320px; }
main { max-width: 1240px; margin: 0 auto; padding: 16px 24px 40px; }
form { display: inline-flex; gap: 8px; align-items: center; margin: 0; }
select, input, button { font: inherit; padding: 6px 10px; border: 1px solid #c8d1db;
                        border-radius: 6px; background: #fff; }
button { background: #3867d6; border-color: #3867d6; color: #fff; cursor: pointer; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 10px;
        padding: 16px 20px; margin: 16px 0; }
.card h2 { margin: 0 0 12px; font-size: 16px; }
.narrow { max-width: 440px; margin: 12vh auto; }
.sign-in { display: flex; flex-direction: column; align-items: stretch; }
.error { color: #c0392b; font-weight: 600; }
.stats { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 12px;
         margin-top: 8px; }
.stat { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 10px 14px; }
.stat span, .stat small { display: block; color: var(--muted); font-size: 12px; }
.stat strong { display: block; font-size: 22px; font-variant-numeric: tabular-nums; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 16px;
          margin: 16px 0; }
figure { margin: 0; background: #fff; border: 1px solid var(--line); border-radius: 10px;
         padding: 12px 14px; }
figcaption { margin-bottom: 6px; color: var(--muted); }
figcaption b { color: var(--ink); }
.legend { float: right; }
.legend span { margin-left: 12px; white-space: nowrap; }
.legend svg { vertical-align: -1px; margin-right: 4px; }
.chart { width: 100%; height: auto; display: block; }
.chart .grid { stroke: var(--line); }
.chart text { font-size: 11px; fill: var(--muted); }
.chart .ytick { text-anchor: end; }
.chart .xtick { text-anchor: middle; }
.chart .bar:hover rect { opacity: 0.8; }
table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: right; padding: 6px 8px; border-bottom: 1px solid var(--line); }
th:first-child, td:first-child { text-align: left; }
th { color: var(--muted); font-weight: 600; font-size: 12px; }
"""
