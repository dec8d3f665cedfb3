"""The protocol's Quint model (spec/) run by its simulator: the library as built passes every
named invariant, each deliberate break violates its own."""
