"""pi0align inside a training script nobody edits (`pi0align attach -- COMMAND`): loaded into every
Python process the command starts through the interpreter's start-up hook (`site/sitecustomize.py`
on PYTHONPATH), it seeds, finds the model through the first optimizer, and runs the Dumper and the
Monitor on it (session.py), as `settings.py` says."""
