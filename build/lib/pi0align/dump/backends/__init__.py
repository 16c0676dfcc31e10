"""The dump's hot path: a step's records and their statistics or samples, by the torch backend (the
reference) or the native one, chosen once."""
