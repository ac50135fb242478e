"""Processes that hold replicas: the rollout node, deltasync serve, the vLLM plugin and the
node that drives it over HTTP."""
