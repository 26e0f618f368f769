"""rlbus: asynchronous, disaggregated RL for LLM agents on Apache Kafka."""
