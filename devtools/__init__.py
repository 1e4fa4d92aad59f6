"""Development tools shared by tests/, bench/ and scripts/ (not shipped in the wheel)."""
