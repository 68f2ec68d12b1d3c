"""Deployment prototyping with real Flower processes (SuperLink + SuperNodes); see docs/DEPLOYMENT.md."""
