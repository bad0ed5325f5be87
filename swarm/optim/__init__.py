"""swarm.optim"""
