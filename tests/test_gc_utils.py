"""freeze_gc_heap: the start-up heap of a serving process leaves the collector's walks; garbage is collected first.
Run in a child interpreter, so that the test process's own heap is never frozen."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import gc, weakref
from engine.runtime.gc_utils import freeze_gc_heap

class Node:
    pass

a = Node(); a.self = a; probe = weakref.ref(a); del a      # a cycle only the collector frees
live = [[i] for i in range(5000)]
n = freeze_gc_heap()
assert probe() is None, "cyclic garbage was frozen instead of collected"
assert n >= 5000 and gc.get_freeze_count() == n, (n, gc.get_freeze_count())
assert not any(o is live for o in gc.get_objects()), "a start-up object is still walked by collections"
later = [[]]
assert any(o is later for o in gc.get_objects()), "objects made after the freeze must stay collectable"
b = Node(); b.self = b; probe = weakref.ref(b); del b
gc.collect()
assert probe() is None, "a cycle made after the freeze was not collected"
print("ok")
"""


def test_freeze_gc_heap_collects_then_freezes():
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
