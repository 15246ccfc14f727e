module ringwright.dev/devcluster/etcd

go 1.24.0

require go.etcd.io/etcd/server/v3 v3.5.35
