"""rjax bench with module constants patched from PATCH='mod:NAME=val,...'; prints which rjax runs."""
import importlib, os, sys
for item in filter(None, os.environ.get("PATCH", "").split(",")):
    target, val = item.split("=")
    mod, name = target.split(":")
    setattr(importlib.import_module(mod), name, int(val))
import rjax
print(rjax.__file__, os.environ.get("PATCH", ""), file=sys.stderr)
from rjax.cli import main
sys.exit(main(sys.argv[1:]))
