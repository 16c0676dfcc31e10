"""The reports of `pi0align bisect`: the console as probes finish, and JSON."""
