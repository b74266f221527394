# The image of docker-compose.yml's worker, beats and producer: the package and its examples.
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY celery_redislock ./celery_redislock
RUN pip install --no-cache-dir .
COPY examples ./examples
# Celery refuses to run a worker as root with pickle, and warns otherwise: run as a user.
RUN useradd --create-home celery
USER celery
