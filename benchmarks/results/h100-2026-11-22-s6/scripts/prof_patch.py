"""profile_decode with module constants patched from PATCH='mod:NAME=val,...'."""
import importlib, os, sys, runpy
sys.path.insert(0, ".")
for item in filter(None, os.environ.get("PATCH", "").split(",")):
    target, val = item.split("=")
    mod, name = target.split(":")
    setattr(importlib.import_module(mod), name, int(val))
    print("patched", mod, name, val)
sys.argv = ["profile_decode.py"] + sys.argv[1:]
runpy.run_path("benchmarks/profile_decode.py", run_name="__main__")
