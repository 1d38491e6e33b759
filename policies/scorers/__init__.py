"""One scorer per module; each returns [0, 1] per replica name, resolved by name in the registry."""
