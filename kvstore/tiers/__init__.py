"""Storage tiers of the kvstore daemon (see kvstore/tiers/base.py for the contract)."""
