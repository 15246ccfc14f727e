// Command etcd is the upstream etcd server (etcdmain), wrapped in a module of our
// own because etcd's root module carries replace directives that `go install` refuses.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
