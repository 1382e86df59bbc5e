# autopar service and CLI (planner + api; the profiler and executor run on the training machines with their own torch)
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY planner ./planner
COPY api ./api
COPY profiler ./profiler
COPY executor ./executor
RUN pip install --no-cache-dir .
EXPOSE 8000
ENTRYPOINT ["autopar"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
