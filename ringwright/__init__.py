"""ringwright: elastic, topology-aware distributed training on Kubernetes."""
