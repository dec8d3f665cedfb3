"""Broker implementations."""
