module firn.test/gospin

go 1.19
