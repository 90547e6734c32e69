"""Beyond one engine: tensor parallel, KV-event consumers and routing over replicas."""
