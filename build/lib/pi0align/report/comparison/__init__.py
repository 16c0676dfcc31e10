"""The reports of `pi0align compare`: console summary, CSV and JSON, the HTML page and its charts."""
