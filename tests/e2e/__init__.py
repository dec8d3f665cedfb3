"""End-to-end tests: service roles in real processes, killed with real signals (DESIGN.md §9)."""
