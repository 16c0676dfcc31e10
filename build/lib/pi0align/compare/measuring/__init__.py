"""Pairing and measuring: records paired across the two runs, their metrics, each call's replay."""
