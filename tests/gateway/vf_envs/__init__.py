"""`verifiers` environments for tests/gateway/test_verifiers.py (`--rollout.agent verifiers:<module>`)."""
