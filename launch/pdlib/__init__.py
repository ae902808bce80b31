"""launch/pd's implementation: env files, supervision, health and verification."""
