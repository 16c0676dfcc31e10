"""Judging: rows against their limits, the call table, the noise models, the explanation of rows."""
