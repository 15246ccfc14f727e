module ringwright.dev/devcluster/prometheus

go 1.26.0

require github.com/prometheus/prometheus v0.315.1 // indirect
