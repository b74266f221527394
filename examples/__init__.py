"""Runnable examples of celery-redislock: see README.md in this folder."""
