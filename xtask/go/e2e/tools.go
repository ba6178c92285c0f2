//go:build tools

// Package tools only records the programs this wrapper module builds besides e2e.test (the
// ginkgo runner, the test images' programs), so that `go mod tidy` keeps their dependencies in
// go.mod and go.sum.
package tools

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
	_ "k8s.io/kubernetes/test/images/agnhost"
	_ "k8s.io/kubernetes/test/images/regression-issue-74839"
)
