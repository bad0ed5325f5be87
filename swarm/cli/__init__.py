"""swarm.cli"""
