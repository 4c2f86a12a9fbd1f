"""Serving with Ray Serve: an OpenAI-compatible FastAPI ingress over the continuous-batching engine.

`deployments/gpt2.yaml` names the app builder `gpt2_platform.serve.app:build_app`.
This module stays empty so that importing the schemas does not pull in Ray Serve.
"""
