"""Pickers: turn weighted totals (or views directly) into a ranked list and a reason."""
