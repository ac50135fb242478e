"""The one click group (main.py) and its commands."""
