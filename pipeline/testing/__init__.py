"""Test support shipped with the library: named fault points and a realistic synthetic
update generator.
"""
