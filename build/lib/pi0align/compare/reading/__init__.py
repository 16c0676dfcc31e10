"""Reading dumps: pi0align dump files and msprobe dump folders into one in-memory shape (`Dump`)."""
