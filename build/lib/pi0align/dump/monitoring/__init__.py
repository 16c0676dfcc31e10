"""The monitor: every module's quantities at every step into monitor.h5, and the alerts they raise."""
