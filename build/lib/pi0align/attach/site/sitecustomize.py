"""The start-up hook of `pi0align attach`: Python imports `sitecustomize` in every process it starts,
and `pi0align attach` puts this folder first on PYTHONPATH. It attaches (when PI0ALIGN_ATTACH says
how), then hands over to the next `sitecustomize` on the path, which this one would hide."""

import importlib.machinery
import importlib.util
import os
import sys


def _attach() -> None:
    try:
        from pi0align.attach.session import attach_from_environment
        from pi0align.errors import UserError
    except ImportError as error:  # an interpreter without pi0align: it runs unattached, and says so
        print(f"pi0align attach: not attached to {sys.executable} ({error})", file=sys.stderr)
        return
    try:
        attach_from_environment()
    except UserError as error:
        print(f"pi0align attach: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as error:  # half attached is worse than not started: say why, in one line
        print(f"pi0align attach: cannot attach to {sys.executable} ({type(error).__name__}: {error})",
              file=sys.stderr)
        raise SystemExit(2) from None


def _next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.getcwd()) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return


if os.environ.get("PI0ALIGN_ATTACH"):
    _attach()
_next_sitecustomize()
