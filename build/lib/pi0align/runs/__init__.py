"""Run folders as data, torch-free: their manifests side by side (`envdiff`), this machine against
the supported versions (`supported`), loss curves as a DataFrame (`curves`), baselines and `check`."""
