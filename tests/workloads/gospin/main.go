// A Go CPU workload for the symbolization tests: main.main -> main.spinOuter -> main.spinLeaf.
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"
)

var sink uint64

//go:noinline
func spinLeaf(x uint64) uint64 {
	for i := 0; i < 100000; i++ {
		x = x*6364136223846793005 + 1442695040888963407
	}
	return x
}

//go:noinline
func spinOuter(deadline time.Time) {
	x := uint64(1)
	for time.Now().Before(deadline) {
		x = spinLeaf(x)
	}
	sink += x
}

func main() {
	secs := 5.0
	if len(os.Args) > 1 {
		if v, err := strconv.ParseFloat(os.Args[1], 64); err == nil {
			secs = v
		}
	}
	fmt.Printf("ready %d\n", os.Getpid())
	spinOuter(time.Now().Add(time.Duration(secs * float64(time.Second))))
}
