"""The version of pi0align, in one place: the package's metadata (pyproject.toml reads it), the
manifests, the reports and `pi0align --version`. A module of its own, so that no part of the
package imports the package root for it."""

__version__ = "0.1.0"
