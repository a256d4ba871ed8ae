"""The loramux gateway and command-line interface."""
