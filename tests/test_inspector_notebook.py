"""assets/inspector_example.ipynb runs top to bottom (its code cells, executed in-process) and its
figure cells produce Plotly figures."""
import importlib.util
import json
from pathlib import Path

import plotly.graph_objects as go

ROOT = Path(__file__).resolve().parents[1]


def test_notebook_cells_run_and_draw():
    nb = json.loads((ROOT / "assets" / "inspector_example.ipynb").read_text())
    spec = importlib.util.spec_from_file_location("build_nb", ROOT / "assets" / "build_inspector_notebook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cells = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    assert cells == [(k, s) for k, s in mod.CELLS]          # the committed notebook matches its builder
    results = mod.run_cells(cells)
    figs = [v for _, v in results if isinstance(v, go.Figure)]
    assert len(figs) == 5 and all(f.layout.height for f in figs)
    table = results[1][1]
    assert "TTFT (ms)" in set(table["Metric"])
