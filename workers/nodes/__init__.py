"""Processes that hold replicas: the rollout node (over a target of its own, or driving a
stock vLLM server over HTTP), deltasync serve and the vLLM plugin."""

# Not a registered target: a rollout node's remote one, a stock `vllm serve` driven over
# HTTP (workers.nodes.rollout.VllmHttp). Here, so that the CLI names it without imports.
HTTP_TARGET = "vllm-http"
