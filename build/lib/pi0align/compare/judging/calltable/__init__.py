"""Stage 2 of the verdict, the call table: per call, the error into it, out of it and introduced by
it, from its records (`calls.py`), what it read beyond them (`sources.py`), what no dumped call
computed (`undumped.py`), each record's error channels (`channels.py`), and how much error a call's
inputs, condition and rounding explain (`bounds.py`)."""
