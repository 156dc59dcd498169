"""What rlcore's HTTP servers (the Tinker API server and the agents' OpenAI-compatible gateway) share:
`guard`, the checks every request passes before it reaches a route."""
