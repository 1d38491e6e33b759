"""Replica simulator."""
