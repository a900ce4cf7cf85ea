"""Client library, demo engine and load generator."""
