"""Deploying schema inbox: the Sqitch wrapper."""
