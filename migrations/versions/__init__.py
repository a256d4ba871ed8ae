"""Revisions, one file each, named `<date>_<slug>.py`, oldest first."""
