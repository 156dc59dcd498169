"""Multi-turn rollouts over any engine (`loop.run_agent`): tools and their chat-template format, text
environments, the calls made concurrently with deadlines, images, and the batch assembled at the end."""
