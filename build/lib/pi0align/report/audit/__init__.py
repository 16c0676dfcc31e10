"""The reports of `pi0align audit`: console, JSON, HTML."""
