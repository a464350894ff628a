"""helmc: an ahead-of-time compiler and small runtime for running an LLM across one CPU and one GPU.

The public API is plain Python; the click CLI in helmc.cli.main is a thin layer over it:

    helmc.profile() -> HardwareProfile
    helmc.plan(model_or_bundle, hardware) -> PlanResult (.plan, .spec)
    helmc.build(model_dir, hardware, out_dir) -> BundleManifest
    helmc.run(bundle_dir, prompt=..., ...) -> GenerationResult

Importing this package is cheap and never imports torch, onnx or the TVM compiler: the runtime
(helmc.runtime) imports it on machines that have only the TVM runtime library.
"""
import os as _os

__version__ = "0.1.0"

# In a source checkout the runtime and schedules live beside this package (runtime/, schedules/)
# and an installed wheel maps them to helmc.runtime / helmc.schedules; extending __path__ makes the
# checkout behave like the wheel, so a bare PYTHONPATH=<checkout> works on the GPU machine.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "runtime", "__init__.py")) and _root not in __path__:
    __path__.append(_root)


def __getattr__(name):
    # Lazy so that `import helmc` stays light (see module docstring).
    if name == "build":
        from helmc.api import build
        return build
    if name == "run":
        from helmc.api import run
        return run
    if name == "plan":
        from helmc.api import plan
        return plan
    if name == "profile":
        from helmc.api import profile
        return profile
    raise AttributeError(f"module 'helmc' has no attribute {name!r}")
