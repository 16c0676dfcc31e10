"""Capturing a step's calls: torch API calls, module forwards, autograd's backward, the optimizer's
update, named stably and with their call sites and arguments."""
